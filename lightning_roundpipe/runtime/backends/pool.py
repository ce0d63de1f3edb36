"""Buffer pools, allocated once the partition and the program are known (DESIGN.md section 4).

Stage weights (:class:`StagePool`, :func:`pool_slots`):

A device holds at most ``plan.max_resident_stages`` stages at once (two: the stage computing and the
next one prefetched). The stream program says which buffer each ``LOAD`` fills: a device's first
loads take fresh slots, every later ``LOAD`` takes the slot its *room* (the ``DROP`` listed before it
in the plan, :class:`~lightning_roundpipe.schedule.lower.Dispatch`) released, and its first chunk
waits for that ``DROP``'s event (an edge of the program). So the slot is known when the ``LOAD`` is
issued, however far the host runs ahead of the device, and a third buffer is never needed: no
allocation in the steady state, no ``record_stream``, and the CUDA caching allocator never has to
synchronise a device to find room.

:func:`pool_slots` is pure (plan -> slot per dispatch); :class:`StagePool` holds one device's buffers.

Transfers (:class:`SlotPool`, :class:`HostStagingPool`): the device-side destinations of the
activation and gradient uploads (``H2D``/``GH2D``), the devices' fp32 gradient accumulators, and the
host staging blocks that downloads land in and that uploads from pageable memory go through. Which
slot each transfer uses is derived from the stream program
(:mod:`~lightning_roundpipe.schedule.buffers`): a slot is refilled only by an op that the
program's edges order after every reader of what the slot held, so reuse needs no
``record_stream`` and no host wait. Slots grow to the largest content they have held (the first,
profiled step learns the sizes) and are then resized once, after the program, for every device
(:meth:`SlotPool.ensure`): no allocation in the steady state. Host data that outlives its program
(boundaries saved for the backward program, the outputs handed to Lightning, downloaded weight
gradients that become ``.grad``) lives in blocks keyed by what they hold
(:meth:`HostStagingPool.keyed`), reused once nothing references them any more.

Every pool counts its allocations (``allocations``): the run-ahead tests read them.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Sequence

import torch
from torch.utils import _pytree as pytree

#: byte alignment of every tensor packed into a pooled buffer (vectorised kernels, any dtype's view)
PACK_ALIGN = 64

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


# ---------------------------------------------------------------------- packing
def _aligned(nbytes: int) -> int:
    return -(-nbytes // PACK_ALIGN) * PACK_ALIGN


def packed_nbytes(tree: Any) -> int:
    """Bytes :func:`pack` needs for the tensors of ``tree`` (each aligned to :data:`PACK_ALIGN`)."""
    return sum(_aligned(t.numel() * t.element_size()) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def pack(tree: Any, buffer: torch.Tensor) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Lay the tensors of ``tree`` out in ``buffer`` (``uint8``, at least :func:`packed_nbytes` long).

    Returns:
        ``tree`` with every tensor replaced by a contiguous view of ``buffer`` of its shape and dtype
        (other leaves kept), and the ``(view, tensor)`` pairs a copy must fill.
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    offset = 0

    def place(t: Any) -> Any:
        nonlocal offset
        if not isinstance(t, torch.Tensor):
            return t
        nbytes = t.numel() * t.element_size()
        view = buffer[offset:offset + nbytes].view(t.dtype).view(t.shape)
        offset += _aligned(nbytes)
        pairs.append((view, t))
        return view

    return pytree.tree_map(place, tree), pairs


# ---------------------------------------------------------------------- slot pools
class SlotPool:
    """Byte buffers indexed by slot: the activation/gradient transfer buffers of one device, the fp32
    gradient accumulators of one device, or the host staging slots.

    Args:
        allocate: ``nbytes -> uint8 tensor`` (the driver's device or host allocation).

    Attributes:
        buffers: per slot its buffer (``None`` before first use).
        allocations: allocations made since the pool was created.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self.buffers: list[torch.Tensor | None] = []
        self.allocations = 0
        self._retired: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def _new(self, nbytes: int) -> torch.Tensor:
        # a normal tensor even under Lightning's inference mode (validation): streams write it later
        with torch.inference_mode(False):
            buffer = self._allocate(max(1, nbytes))
        self.allocations += 1
        return buffer

    def take(self, slot: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes of ``slot``'s buffer, from inside the op that fills it.

        A slot smaller than ``nbytes`` (the first step, or a longer sequence) gets a new buffer; the
        old one is kept until :meth:`end_program` (ops issued earlier may still read it).
        """
        with self._lock:
            while len(self.buffers) <= slot:
                self.buffers.append(None)
            buffer = self.buffers[slot]
            if buffer is None or buffer.numel() < nbytes:
                if buffer is not None:
                    self._retired.append(buffer)
                buffer = self.buffers[slot] = self._new(nbytes)
        return buffer[:nbytes]

    def ensure(self, sizes: Sequence[int]) -> None:
        """Make slot ``k`` at least ``sizes[k]`` bytes (only between programs: nothing reads the old ones)."""
        with self._lock:
            while len(self.buffers) < len(sizes):
                self.buffers.append(None)
            for slot, nbytes in enumerate(sizes):
                buffer = self.buffers[slot]
                if nbytes > 0 and (buffer is None or buffer.numel() < nbytes):
                    self.buffers[slot] = None  # free the smaller one first
                    self.buffers[slot] = self._new(nbytes)

    def end_program(self) -> None:
        """After a program has completed: free the buffers :meth:`take` replaced."""
        with self._lock:
            self._retired.clear()

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds."""
        return sum(b.numel() for b in self.buffers if b is not None) + sum(b.numel() for b in self._retired)

    def clear(self) -> None:
        with self._lock:
            self.buffers = []
            self._retired.clear()


def _use_count(tensor: torch.Tensor) -> int:
    """References to ``tensor``'s storage (every tensor viewing it holds one)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class HostStagingPool:
    """Host staging blocks (pinned on CUDA, exact sizes: not torch's power-of-two pinned cache).

    - :attr:`slots` (:class:`SlotPool`): host data read only inside its own program (a boundary the
      next stage uploads, an input gradient the next backward stage uploads); the program gives each
      content a slot (:mod:`~lightning_roundpipe.schedule.buffers`).
    - :meth:`keyed`: data that outlives its program or is read by the host: blocks keyed by what they
      hold (``("act", layer_index, microbatch_index)``, ``("wgrad", stage_index, round_index)``...);
      a block is reused by the next program once nothing but the pool references it, so a saved
      boundary, an output or a ``.grad`` still in use is never overwritten (another block is made).

    Args:
        allocate: ``nbytes -> uint8 host tensor``.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self.slots = SlotPool(allocate)
        self._keyed: dict[Hashable, list[tuple[torch.Tensor, int]]] = {}
        self._keyed_allocations = 0
        self._lock = threading.Lock()

    @property
    def allocations(self) -> int:
        """Host allocations made since the pool was created (slots and keyed blocks)."""
        return self.slots.allocations + self._keyed_allocations

    def keyed(self, key: Hashable, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes of a block for ``key`` that nothing else references (call once per key and
        program: the previous program that used the block has completed)."""
        with self._lock:
            chain = self._keyed.setdefault(key, [])
            for position, (block, alone) in enumerate(chain):
                if _use_count(block) != alone:
                    continue  # still referenced: a saved boundary, an output, a .grad
                if block.numel() >= nbytes:
                    return block[:nbytes]
                del block, chain[position]  # free and too small: replaced by an exact-size block
                break
            chain.append(self._new(nbytes))
            return chain[-1][0][:nbytes]

    def _new(self, nbytes: int) -> tuple[torch.Tensor, int]:
        with torch.inference_mode(False):
            block = self._allocate(max(1, nbytes))
        self._keyed_allocations += 1
        return block, _use_count(block)

    def end_program(self) -> None:
        self.slots.end_program()

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds."""
        return self.slots.nbytes + sum(b.numel() for chain in self._keyed.values() for b, _ in chain)

    def clear(self) -> None:
        self.slots.clear()
        with self._lock:
            self._keyed.clear()
