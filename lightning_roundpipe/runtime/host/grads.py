"""Weight gradients of a backward stage, summed over its microbatches in fp32 on the device.

DESIGN.md section 5: "gradients of a stage are accumulated over its microbatches in fp32". A
backward stage's parameters on the device are views into the stage's upload buffer, in the compute
dtype; autograd writes each microbatch's gradient into ``view.grad`` in that dtype. Left alone,
autograd would also *sum* the microbatches there, so under bf16-mixed every microbatch's
contribution is rounded to bf16 once more (the relative error against fp32 grows with
``num_microbatches``). Instead, after every ``B``/``X`` op the stage's :class:`GradAccumulator`
adds each ``view.grad`` into an fp32 flat device buffer and clears ``view.grad``; ``WD2H``
downloads that buffer (fp32 bytes) and the host adds it into the masters' ``.grad``.

When a view is fp32 already (``32-true``) autograd's own accumulation is exact: no accumulator, the
download reads ``view.grad`` directly (zero copies, as before). Views wider than 32 bits
(``64-true``) are never accumulated in a narrower dtype.

The fp32 buffer is a slot of the device's accumulator pool (DESIGN.md section 4: allocated once,
sized to the largest backward stage, one slot per stage weight slot), the slot of the stage's
weights: :meth:`GradAccumulator.add` zeroes and fills it on the ``compute`` stream inside the
``B``/``X`` handlers, ``WD2H`` reads it on the ``d2h`` stream after the stage's last backward op,
and the next stage that takes the slot writes it only after its ``LOAD``, which waits for this
stage's ``DROP`` (after the ``WD2H`` on the same stream): reuse follows the program's edges, with no
``record_stream`` and no allocation.
"""

from __future__ import annotations

import torch

#: dtype of the device-side sum of a stage's microbatch gradients
ACCUMULATE_DTYPE = torch.float32


def needs_fp32_accumulation(dtype: torch.dtype) -> bool:
    """Whether gradients of a parameter view of ``dtype`` are summed in an fp32 accumulator
    (floating-point dtypes narrower than 32 bits: bf16, fp16, fp8)."""
    return dtype.is_floating_point and dtype.itemsize < ACCUMULATE_DTYPE.itemsize


def download_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes the ``WD2H`` of one parameter moves: ``numel`` elements of ``dtype`` gradients,
    in fp32 where they are accumulated in fp32, else in ``dtype``."""
    return numel * (ACCUMULATE_DTYPE.itemsize if needs_fp32_accumulation(dtype) else dtype.itemsize)


class GradAccumulator:
    """fp32 sum of a resident backward stage's low-precision weight gradients over its microbatches.

    Args:
        pairs: ``(master, view)`` of the stage's trainable parameters whose device view has a
            floating-point dtype narrower than fp32 (:func:`needs_fp32_accumulation`).
        buffer: device memory for the sum (``uint8``, at least :attr:`nbytes`; a pool slot), or
            ``None`` to allocate it at the first :meth:`add`.

    Attributes:
        flat: the fp32 device buffer, ``(sum of numel,)``; ``None`` until the first :meth:`add`.
        touched: per pair, whether some microbatch gave that parameter a gradient (parameters that
            got none keep ``.grad`` untouched on the host, as with autograd).
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], buffer: torch.Tensor | None = None) -> None:
        self.pairs = pairs
        self._buffer = buffer
        self.offsets: list[int] = []
        total = 0
        for _, view in pairs:
            self.offsets.append(total)
            total += view.numel()
        self.numel = total
        self.flat: torch.Tensor | None = None
        self.slices: list[torch.Tensor] = []
        self.touched = [False] * len(pairs)

    @property
    def nbytes(self) -> int:
        """Bytes of the fp32 buffer (what ``WD2H`` downloads)."""
        return self.numel * ACCUMULATE_DTYPE.itemsize

    def add(self) -> None:
        """Add every ``view.grad`` into the fp32 buffer and set ``view.grad = None`` (call on the
        compute stream right after a microbatch's backward)."""
        for k, (_, view) in enumerate(self.pairs):
            grad = view.grad
            if grad is None:
                continue
            if self.flat is None:
                if self._buffer is None:
                    self.flat = torch.zeros(self.numel, dtype=ACCUMULATE_DTYPE, device=view.device)
                else:  # the pool slot (it held an earlier stage's sum)
                    self.flat = self._buffer[:self.nbytes].view(ACCUMULATE_DTYPE).zero_()
                self.slices = [self.flat[o:o + v.numel()].view(v.shape) for o, (_, v) in zip(self.offsets, self.pairs)]
            self.slices[k].add_(grad)
            self.touched[k] = True
            view.grad = None

    def host_pairs(self, host_flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(master, fp32 host gradient)`` of the touched parameters, as views of ``host_flat``
        (the downloaded :attr:`flat`)."""
        return [(master, host_flat[o:o + view.numel()].view(view.shape))
                for (master, view), o, hit in zip(self.pairs, self.offsets, self.touched) if hit]
