"""Per-device pool of stage weight buffers, allocated once the partition is known (DESIGN.md section 4).

A device holds at most ``plan.max_resident_stages`` stages at once (two: the stage computing and the
next one prefetched). The stream program says which buffer each ``LOAD`` fills: a device's first
loads take fresh slots, every later ``LOAD`` takes the slot its *room* (the ``DROP`` listed before it
in the plan, :class:`~lightning_roundpipe.schedule.lower.Dispatch`) released, and its first chunk
waits for that ``DROP``'s event (an edge of the program). So the slot is known when the ``LOAD`` is
issued, however far the host runs ahead of the device, and a third buffer is never needed: no
allocation in the steady state, no ``record_stream``, and the CUDA caching allocator never has to
synchronise a device to find room.

:func:`pool_slots` is pure (plan -> slot per dispatch); :class:`StagePool` holds one device's buffers.
"""

from __future__ import annotations

from typing import Callable

import torch

from lightning_roundpipe.schedule.lower import plan_dispatches


def pool_slots(plan) -> dict[tuple[int, int, int], int]:
    """``(device_index, stage_index, round_index) -> slot`` for every dispatch of ``plan`` (cached).

    Walks each device's plan list: a ``LOAD`` takes the slot its room released when that slot is free
    (the ``DROP`` its first chunk waits for), else the lowest free slot (released by an earlier ``DROP``
    of the same stream, so also waited for), else a fresh one; a ``DROP`` frees its slot.
    """
    cached = plan._meta.get("_pool_slots")
    if cached is not None:
        return cached
    from lightning_roundpipe.schedule.ir import ActionKind

    by_load = {(x.device_index, x.load_position): x for x in plan_dispatches(plan)}
    slots: dict[tuple[int, int, int], int] = {}
    for device_index, actions in enumerate(plan.actions):
        free: set[int] = set()
        fresh = 0
        open_: dict[int, tuple[int, int, int]] = {}
        for position, action in enumerate(actions):
            if action.kind is ActionKind.LOAD:
                dispatch = by_load[(device_index, position)]
                key = (device_index, dispatch.stage_index, dispatch.round_index)
                room = slots.get((device_index, *dispatch.room)) if dispatch.room is not None else None
                if room is not None and room in free:
                    slot = room
                elif free:
                    slot = min(free)
                else:
                    slot, fresh = fresh, fresh + 1
                free.discard(slot)
                slots[key] = slot
                open_[action.stage_index] = key
            elif action.kind is ActionKind.DROP:
                free.add(slots[open_.pop(action.stage_index)])
    plan._meta["_pool_slots"] = slots
    return slots


class StagePool:
    """The stage weight buffers of one device.

    Args:
        allocate: ``nbytes -> uint8 tensor`` on the device (the driver's allocation; a CPU virtual
            device with a memory budget counts it there).

    Attributes:
        buffers: the slots' buffers (``uint8``, each ``slot_bytes`` long).
        slot_bytes: size of every slot, bytes (the largest stage reserved so far).
        allocations: device allocations made by the pool since it was created (the run-ahead test
            reads it: constant after the first step).
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self.buffers: list[torch.Tensor] = []
        self.slot_bytes = 0
        self.allocations = 0

    def reserve(self, num_slots: int, nbytes: int) -> None:
        """Make sure there are ``num_slots`` slots of at least ``nbytes`` bytes each.

        Called by the host before a program is issued (every earlier program has completed). A larger
        stage than before replaces every slot (a new partition); otherwise nothing is allocated.

        Raises:
            DeviceMemoryError / torch.OutOfMemoryError: the slots do not fit the device.
        """
        if nbytes > self.slot_bytes:
            self.buffers = []  # free the old slots before the larger ones are made
            self.slot_bytes = nbytes
        while len(self.buffers) < num_slots:
            # a normal tensor even when the host is in Lightning's inference mode (validation): the
            # copy engines write into it from their own threads, outside that mode
            with torch.inference_mode(False):
                self.buffers.append(self._allocate(self.slot_bytes))
            self.allocations += 1

    def buffer(self, slot: int) -> torch.Tensor:
        """The buffer of ``slot`` (reserved before)."""
        return self.buffers[slot]

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds on the device."""
        return len(self.buffers) * self.slot_bytes

    def clear(self) -> None:
        self.buffers = []
        self.slot_bytes = 0
