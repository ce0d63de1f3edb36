"""Schedule jitter: the checking mode's seeded random delays (DESIGN.md section 4 (d)).

A race between the main thread and an overlapped run (the next batch's forward issued while the
previous batch's backward drains; the asynchronous optimizer's step in flight) shows only when the
threads happen to interleave in the bad order; on an idle machine they rarely do. With jitter on,
every thread RoundPipe runs sleeps a small random time at the points where a busy scheduler could
delay it:

- each item a CPU virtual device's stream worker takes (an op, an event's completion, a wait;
  :class:`~lightning_roundpipe.runtime.backends.cpu.CpuStream`);
- each op a stream's issuing thread issues, and each job of every
  :class:`~lightning_roundpipe.runtime.execution.devices.StreamThread` (the issuing threads, the host
  gradient adds, the shadow refresh, the asynchronous optimizer's thread);
- each backward dispatch the host thread adds into the masters' gradients and each tensor the refresh
  copies;
- the main thread before it returns from the pipelined forward and from its backward.

A delay only postpones what a thread does next: every order the stream program, the events and the
host's waits fix stays as it is, so a correct program gives the same result under any seed (bitwise
where the op order on each thread is fixed), and a missing wait can fail.

Each thread draws its delays from its own ``random.Random`` seeded with (the seed, the thread's
name), so a seed gives every thread the same sequence of delays in every run (the operating system's
own scheduling still varies). A delay is uniform in ``[0, max_delay_s]`` (default 2 ms), or, with
probability ``stall_probability`` (default 1 %), a stall uniform in ``[0, stall_s]`` (default 20 ms), as
when the operating system deschedules a thread on a busy machine. A race that needs one thread to fall
far behind all the others (a worker that completes an event and only much later the marker after it,
while the other threads' chains of work run on) rarely shows with delays every thread shares alike:
scale that thread's delays up (``scales``, e.g. ``{"compute-worker": 50}``: a GPU whose compute stream
runs far behind; :class:`Jitter`, :func:`set_jitter`).

Turned on by ``LIGHTNING_ROUNDPIPE_JITTER_SEED=<int>`` (unset or empty: off; read at every pause, so a
test can set it for one fit) or, for the whole process, by :func:`set_jitter` (which wins over the
variable). Costs one dictionary lookup per pause when off.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time

#: Environment variable holding the jitter seed (an int; unset or empty: jitter off).
JITTER_ENV = "LIGHTNING_ROUNDPIPE_JITTER_SEED"
#: Longest delay of one pause, seconds.
MAX_DELAY_S = 0.002
#: Probability that a pause is a stall, and the longest stall, seconds.
STALL_PROBABILITY = 0.01
STALL_S = 0.02

_UNSET = object()


class Jitter:
    """Seeded random delays, one ``random.Random`` per thread.

    Args:
        seed: the run's jitter seed (any int).
        max_delay_s: longest delay of an ordinary pause, seconds (``>= 0``).
        stall_probability: probability that a pause is a stall (in ``[0, 1]``).
        stall_s: longest stall, seconds (``>= 0``).
        scales: ``{thread name part: factor}``: a thread whose name contains a key has its delays
            multiplied by that factor (the first match; e.g. ``{"compute-worker": 20}``).

    Raises:
        TypeError: ``seed`` not an int.
        ValueError: ``max_delay_s`` or ``stall_s`` negative or not finite, ``stall_probability``
            outside ``[0, 1]``, a negative or infinite scale.
    """

    def __init__(self, seed: int, max_delay_s: float = MAX_DELAY_S, stall_probability: float = STALL_PROBABILITY,
                 stall_s: float = STALL_S, scales: dict[str, float] | None = None) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"The jitter `seed` must be an int, got {seed!r}. HINT: e.g. `set_jitter(0)`.")
        for name, value in (("max_delay_s", max_delay_s), ("stall_s", stall_s)):
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(f"`{name}` must be a finite number of seconds >= 0, got {value!r}."
                                 " HINT: a few milliseconds, e.g. 0.002.")
        if isinstance(stall_probability, bool) or not (isinstance(stall_probability, (int, float))
                                                       and 0 <= stall_probability <= 1):
            raise ValueError(f"`stall_probability` must be a number in [0, 1], got {stall_probability!r}."
                             " HINT: e.g. 0.01 for one stall in a hundred pauses.")
        self.seed = seed
        self.max_delay_s = float(max_delay_s)
        self.stall_probability = float(stall_probability)
        self.stall_s = float(stall_s)
        self.scales = dict(scales or {})
        if not all(isinstance(f, (int, float)) and 0 <= f < float("inf") for f in self.scales.values()):
            raise ValueError(f"`scales` must map thread name parts to finite factors >= 0, got {scales!r}."
                             " HINT: e.g. `{'compute-worker': 20}`.")
        self._local = threading.local()

    def thread_random(self) -> random.Random:
        """The calling thread's generator: seeded with the first 8 bytes of the BLAKE2b digest of
        ``"{seed}:{thread name}"`` at the thread's first pause."""
        rng = getattr(self._local, "random", None)
        if rng is None:
            name = threading.current_thread().name
            digest = hashlib.blake2b(f"{self.seed}:{name}".encode(), digest_size=8).digest()
            rng = self._local.random = random.Random(int.from_bytes(digest, "little"))
            self._local.scale = next((f for part, f in self.scales.items() if part in name), 1.0)
        return rng

    def delay_s(self) -> float:
        """This thread's next delay, seconds: uniform in ``[0, stall_s]`` with probability
        ``stall_probability``, else uniform in ``[0, max_delay_s]``."""
        rng = self.thread_random()
        longest = self.stall_s if rng.random() < self.stall_probability else self.max_delay_s
        return rng.uniform(0.0, longest) * self._local.scale

    def pause(self) -> None:
        """Sleep this thread's next delay (:meth:`delay_s`)."""
        time.sleep(self.delay_s())


_forced: object = _UNSET  # set_jitter's value (a Jitter or None), else the environment decides
_from_env: tuple[str, Jitter | None] = ("", None)


def set_jitter(seed: int | None, max_delay_s: float = MAX_DELAY_S, stall_probability: float = STALL_PROBABILITY,
               stall_s: float = STALL_S, scales: dict[str, float] | None = None) -> None:
    """Turn jitter on for the whole process with ``seed`` and these delays (:class:`Jitter`; ``seed=None``:
    off), over the environment variable; :func:`reset_jitter` gives the decision back to the variable.

    Raises:
        TypeError, ValueError: as :class:`Jitter`.
    """
    global _forced
    _forced = None if seed is None else Jitter(seed, max_delay_s, stall_probability, stall_s, scales)


def reset_jitter() -> None:
    """Let ``LIGHTNING_ROUNDPIPE_JITTER_SEED`` decide again (undoes :func:`set_jitter`)."""
    global _forced
    _forced = _UNSET


def active_jitter() -> Jitter | None:
    """The jitter in force: :func:`set_jitter`'s, else the environment variable's (``None``: off).

    Raises:
        ValueError: ``LIGHTNING_ROUNDPIPE_JITTER_SEED`` set to something other than an int.
    """
    global _from_env
    if _forced is not _UNSET:
        return _forced  # type: ignore[return-value]
    value = os.environ.get(JITTER_ENV, "").strip()
    cached_value, cached = _from_env
    if value == cached_value:
        return cached
    if not value:
        jitter = None
    else:
        try:
            jitter = Jitter(int(value))
        except ValueError:
            raise ValueError(f"`{JITTER_ENV}={value}` is not an int. HINT: `export {JITTER_ENV}=0` turns schedule"
                             f" jitter on with seed 0; unset it to turn jitter off.") from None
    _from_env = (value, jitter)
    return jitter


def pause() -> None:
    """One jitter point: sleep this thread's next random delay when jitter is on (else return at once)."""
    jitter = active_jitter()
    if jitter is not None:
        jitter.pause()
