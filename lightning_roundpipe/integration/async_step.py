"""The asynchronous optimizer for Lightning: ``RoundPipeStrategy(optimizer="async")``.

RoundPipe paper (arXiv 2604.27085), section 4 ("RoundPipe" vs "RoundPipe-sync"): the CPU
optimizer step of step k runs on a background thread while the devices compute step k+1 on the
weights from before that step. The mechanism is
:class:`~lightning_roundpipe.runtime.host.async_optimizer.BackgroundStepper`; this module wires it into
Lightning's training loop:

- ``optimizer.step`` is replaced, for the duration of the precision plugin's ``optimizer_step``,
  by a function that runs the closure in the main thread (``training_step``, ``zero_grad``,
  ``backward``, then ``on_before_optimizer_step`` and gradient clipping, all on the step's exact
  gradient) and records the step instead of running it. After the plugin returns, the main thread
  waits for the step in flight, refreshes the pipeline's weight snapshot from the masters and
  submits the recorded step to the thread.
- ``optimizer.zero_grad`` and ``LightningModule.lr_scheduler_step`` called while a step is in
  flight are queued and run in the main thread right after the next wait (so after that step, in
  Lightning's order); gradients are written into ``.grad`` only after a wait
  (:attr:`RoundPipeEngine.grad_barrier`). The thread runs ``optimizer.step()`` alone: it reads
  ``.grad`` while no other thread sets it (setting a tensor's ``.grad`` while another thread reads
  it can crash torch).
- Everything else that reads the masters waits first: checkpoints (the strategy's
  ``lightning_module_state_dict``/``optimizer_state``/``save_checkpoint``), the start of validation
  (which also refreshes the snapshot), ``on_validation_model_zero_grad``, the end of every training
  epoch and of fit, exceptions and teardown.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_roundpipe.config import OPTIMIZER_MODES  # validated in RoundPipeConfig
from lightning_roundpipe.runtime.backends.threads import limit_this_thread
from lightning_roundpipe.runtime.host.async_optimizer import BackgroundStepper
from lightning_roundpipe.runtime.host.staleness import StalenessCorrection, make_staleness_correction
from lightning_roundpipe.runtime.execution.installed import InstalledMethod

STALENESS_CHECKPOINT_KEY = "roundpipe_staleness"
"""The checkpoint key of the staleness correction's state (:meth:`AsyncOptimizer.correction_state`)."""


def check_optimizer_mode(value: Any) -> str:
    """``value`` if it is a valid ``RoundPipeStrategy(optimizer=...)``.

    Raises:
        ValueError: for anything but ``"sync"`` and ``"async"``.
    """
    if not isinstance(value, str) or value not in OPTIMIZER_MODES:
        raise ValueError(
            f"`optimizer` must be one of {list(OPTIMIZER_MODES)}, got {value!r}. HINT: 'sync' (default) keeps"
            " Lightning's exact semantics; 'async' overlaps the CPU optimizer step with the next step's pipeline"
            " (weights one step stale, RoundPipe paper section 4)."
        )
    return value


class _WaitCallback(Callback):
    """Waits for the step in flight where Lightning's loops read the weights between steps."""

    def __init__(self, controller: "AsyncOptimizer") -> None:
        self.controller = controller

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.controller.synchronize()  # weights restored from a checkpoint reach the snapshot

    @override
    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self.controller.synchronize()

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.controller.synchronize()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # the steady state's last step of an epoch or of fit: its hooks run (and log) within this batch
        loop = trainer.fit_loop.epoch_loop
        if self.controller.steady and (loop.batch_progress.is_last_batch or trainer.should_stop
                                       or 0 <= trainer.max_steps <= trainer.global_step):
            self.controller.settle()

    @override
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.controller.settle()

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.controller.synchronize()


class AsyncOptimizer:
    """Runs the optimizer steps of a fit on a background CPU thread (paper section 4).

    Created and installed by :class:`~lightning_roundpipe.RoundPipeStrategy` at ``setup`` of a fit
    with ``optimizer="async"``; see its docstring for the staleness.

    Attributes:
        stepper: the :class:`BackgroundStepper` (``None`` until :meth:`install`).
        steps_submitted: optimizer steps handed to the thread so far.
    """

    def __init__(self, steady: bool = False, staleness_correction: str | None = None,
                 staleness_correction_lambda: float = 0.0) -> None:
        self.steady = steady
        """The steady state (DESIGN.md section 11): a step's pipeline may still drain when its backward
        returns; the next step's pipeline is issued behind it (the strategy marks which batches)."""
        self.stepper: BackgroundStepper | None = None
        self.engine = None
        self.steps_submitted = 0
        self._held: _HeldStep | None = None  # a recorded step whose gradients are not complete yet
        self._after_held: list[Callable[[], Any]] = []  # deferred calls that belong after the held step's update
        self._snapshot_lag = 0  # updates handed to the thread since the pipeline's snapshot was taken
        self._precision = None
        self._patches: list[tuple[Any, str, bool, Any]] = []
        self._after_wait: list[Callable[[], Any]] = []  # deferred calls, run in order after the next wait
        self._callback: _WaitCallback | None = None
        self._trainer = None
        self.correction_kind = staleness_correction
        """``RoundPipeConfig.staleness_correction`` (``runtime/host/staleness.py``)."""
        self._correction_lambda = staleness_correction_lambda
        self.correction: StalenessCorrection | None = None
        # which updates each snapshot holds: updates handed over so far, and per bank that count when it
        # was refreshed; a step whose snapshot holds fewer than the updates made before its own is stale
        self._updates = 0
        self._bank_updates = [0, 0]
        self._forward_updates: int | None = None  # the steady state: the snapshot of the fused program just issued
        self._snapshot_plain = True  # the snapshot is the masters (not predicted)
        self._cpu = False  # CPU virtual devices: the main thread's correction runs on one intra-op thread

    # ------------------------------------------------------------------ install / uninstall
    def install(self, trainer: Any, lightning_module: Any, optimizers: list, engine: Any,
                precision: Any = None) -> None:
        """Check the fit can run asynchronously, then hook the optimizers, the module and the engine
        (and, in the steady state, ``precision``: the strategy's precision plugin, whose
        ``_after_closure`` (``on_before_optimizer_step`` hooks and clipping) waits for the gradients).

        Raises:
            ValueError: for manual optimization, an optimizer that re-evaluates its closure
                (``torch.optim.LBFGS``), or an optimizer updating parameters outside the pipelined
                module.
        """
        _check_supported(lightning_module, optimizers, engine)
        self.engine = engine
        # on CPU virtual devices the devices' threads go first; the step takes the idle cycles, on one
        # intra-op thread (an OpenMP team would wait for cores the devices hold)
        cpu = all(d.type == "cpu" for d in engine.devices)
        self.stepper = BackgroundStepper(niceness=10 if cpu else None, intra_op_threads=1 if cpu else None)
        self._cpu = cpu
        engine.store.snapshot = True
        engine.store.refresh(force=True)
        engine.grad_barrier = self.wait
        self._precision = precision
        if self.correction_kind is not None:
            names = {id(p): n for n, p in lightning_module.named_parameters()}
            trained = list({id(p): p for o in optimizers for g in o.param_groups for p in g["params"]
                            if p.requires_grad}.values())
            self.correction = make_staleness_correction(self.correction_kind, trained, [names[id(p)] for p in trained],
                                                        self._correction_lambda)
        if self.steady:
            engine.before_fused_start = self._before_program
            engine.on_gradients_complete = self._gradients_complete
            engine.overlaps_steps = True  # the automatic choice and the predictions simulate the steady state
        for optimizer in optimizers:
            self._patch(optimizer, "zero_grad", self._deferred(optimizer.zero_grad))
        self._patch(lightning_module, "lr_scheduler_step",
                    self._deferred(lightning_module.lr_scheduler_step))
        zero_grad_hook = lightning_module.on_validation_model_zero_grad

        def on_validation_model_zero_grad() -> None:
            self.wait()
            zero_grad_hook()

        self._patch(lightning_module, "on_validation_model_zero_grad", on_validation_model_zero_grad)
        self._trainer = trainer
        self._callback = _WaitCallback(self)
        trainer.callbacks.insert(0, self._callback)

    def uninstall(self) -> None:
        """Wait for the thread (dropping errors: they were raised already), stop it, undo every hook."""
        if self.stepper is not None:
            self.stepper.close()
            self.stepper = None
        self.correction = None
        self._after_wait.clear()
        self._after_held.clear()
        self._held = None
        for owner, name, had, old in reversed(self._patches):
            if had:
                owner.__dict__[name] = old
            else:
                owner.__dict__.pop(name, None)
        self._patches.clear()
        if self.engine is not None:
            self.engine.grad_barrier = None
            self.engine.before_fused_start = self.engine.on_gradients_complete = None
            self.engine.overlaps_steps = False
            self.engine.store.end_snapshot()
            self.engine = None
        if self._trainer is not None and self._callback in self._trainer.callbacks:
            self._trainer.callbacks.remove(self._callback)
        self._callback = self._trainer = None

    def _patch(self, owner: Any, name: str, value: Callable) -> None:
        """``owner.<name> = value`` until :meth:`uninstall`, as an ``InstalledMethod``: a deep copy or pickle of
        ``owner`` meanwhile (weight averaging callbacks copy the LightningModule) gets ``owner``'s own method."""
        had = name in owner.__dict__
        self._patches.append((owner, name, had, owner.__dict__.get(name)))
        owner.__dict__[name] = InstalledMethod(value, owner, name, owner.__dict__.get(name) if had else None)

    def _deferred(self, original: Callable) -> Callable:
        """``original``, run in the main thread after the next wait when a step is in flight, else now."""

        @functools.wraps(original)
        def deferred(*args: Any, **kwargs: Any) -> Any:
            if self._held is not None:  # called after a step whose update is not handed over yet
                self._after_held.append(functools.partial(original, *args, **kwargs))
                return None
            if self.stepper is not None and self.stepper.pending:
                self._after_wait.append(functools.partial(original, *args, **kwargs))
                return None
            return original(*args, **kwargs)

        return deferred

    # ------------------------------------------------------------------ waits
    def wait(self, raise_errors: bool = True) -> None:
        """Block until the step in flight has run, then run the calls deferred behind it
        (``zero_grad``, LR scheduler steps) in the main thread, in order.

        Args:
            raise_errors: re-raise the step's exception; ``False`` (exceptions, teardown): drop it
                and the deferred calls.

        Raises:
            The exception of the failed step (its type kept), when ``raise_errors``.
        """
        if self.stepper is None:
            return
        try:
            self.stepper.wait(raise_errors)
        except BaseException:
            self._after_wait.clear()
            raise
        queued, self._after_wait = self._after_wait, []
        if raise_errors:
            for call in queued:
                call()

    def settle(self) -> None:
        """In the steady state, drain the pipeline first (the held step's gradients complete, its hooks
        run and its update handed to the thread: :meth:`_gradients_complete`); then :meth:`wait`."""
        if self.steady and self.engine is not None:
            self.engine.drain()
        self.wait()

    def synchronize(self) -> None:
        """:meth:`settle`, then refresh the pipeline's weight snapshot from the masters (the next
        step computes on the current weights)."""
        self.settle()
        if self.engine is not None:
            self._refresh()

    def _refresh(self, stale: bool = False) -> None:
        """Refresh the pipeline's snapshot from the masters; ``stale``: for a step that will lack the
        next update (``weight_prediction`` then predicts the weights)."""
        store = self.engine.store
        predict = stale and self.correction is not None and self.correction.predicts_weights
        if self.steady:  # into the bank no run in flight reads, off the main thread
            target = 1 - store.read_bank
            if any(run.shadow_bank == target and not run.done for run in self.engine.executor.in_flight):
                raise RuntimeError("RoundPipe: a weight snapshot refresh would overwrite the bank a running"
                                   " pipeline uploads from (internal error; please report it).")
            self._refresh_on_thread(store, predict)
        elif predict:
            with self._one_intra_op_thread():
                for key in store.snapshot_keys():
                    store.refresh_entry(key, self._predicted(store.tensors[key].master))
        else:
            store.refresh(force=True)
        self._snapshot_lag = 0
        self._bank_updates[store.read_bank] = self._updates
        self._snapshot_plain = not predict

    def _refresh_on_thread(self, store: Any, predict: bool = False) -> None:
        """The steady state's snapshot refresh (DESIGN.md section 4: it runs off the main thread, per
        tensor in upload order, with an event per tensor): the bank flips now, the copies run on the
        optimizer thread ahead of the next optimizer step (which changes the masters only after
        them), and a run reading the bank waits in each stage's first upload for its tensors' events
        (``WeightStore.refresh_events``)."""
        bank, keys = store.begin_snapshot_refresh()
        events = {key: threading.Event() for key in keys}
        store.refresh_events = (bank, events)

        def release() -> None:
            for event in events.values():
                event.set()

        def refresh() -> None:
            try:
                for key in keys:
                    if predict:
                        store.copy_to_bank(key, bank, self._predicted(store.tensors[key].master))
                    else:
                        store.copy_to_bank(key, bank)
                    events[key].set()
            finally:
                release()  # a failed copy raises at the next wait; the uploads must not hang meanwhile

        self.stepper.submit(refresh, "weight snapshot refresh", on_skip=release, optimizer_step=False)

    # ------------------------------------------------------------------ steady state
    def _before_program(self) -> None:
        """Before a fused program is issued: its snapshot must hold every update but the latest
        step's (one step stale). With a step held for its gradients, that is every update handed
        over; else the one in flight may be missing."""
        held = self._held is not None
        predicting = self.correction is not None and self.correction.predicts_weights
        if self._snapshot_lag > (0 if held else 1) or (predicting and held and self._snapshot_plain):
            self.wait()
            self._refresh(stale=held)
        self._forward_updates = self._bank_updates[self.engine.store.read_bank]

    def _gradients_complete(self) -> None:
        """The engine added the last overlapped gradients into ``.grad``: the held step's hooks and
        clipping run now, then its update goes to the thread."""
        if self._held is not None:
            step, self._held = self._held, None
            self._complete(step)

    def _complete(self, step: "_HeldStep") -> None:
        for hook in step.hooks:  # `on_before_optimizer_step` hooks and clipping, on the complete gradient
            hook()
        if self.correction is not None:
            self.correction.commit(bool(step.updates))
        predicting = self.correction is not None and self.correction.predicts_weights
        if self._snapshot_lag > 0 or not step.updates or (predicting and self._snapshot_plain):
            self.wait()  # the next pipeline's weights: all but this update
            self._refresh(stale=bool(step.updates))
        for index, kwargs in enumerate(step.updates):  # none when the plugin skipped the step (e.g. inf gradients)
            self.steps_submitted += 1
            update = functools.partial(step.step, **kwargs)
            if index == 0 and self.correction is not None:
                update = functools.partial(_after, self.correction.before_update, update)
            self.stepper.submit(update, f"optimizer step {self.steps_submitted}")
        if step.updates:
            self._snapshot_lag += 1
            self._updates += 1
        queued, self._after_held = self._after_held, []
        if self.stepper.pending:
            self._after_wait.extend(queued)
        else:
            for call in queued:
                call()

    def _after_gradients(self, snapshot_updates: int, original_after: Callable, model: Any, optimizer: Any) -> None:
        """The step's gradient is complete (every update before it applied): correct it if its
        snapshot lacked an update, then the plugin's ``on_before_optimizer_step`` hooks and clipping."""
        if self.correction is not None:
            start = time.perf_counter()
            with self._one_intra_op_thread():
                self.correction.correct_gradients(stale=self._updates > snapshot_updates)
            self.stepper.count_step_time(time.perf_counter() - start)  # part of the host's `OPT` op
        original_after(model, optimizer)

    @contextlib.contextmanager
    def _one_intra_op_thread(self):
        """On CPU virtual devices, the main thread's correction on one intra-op thread (as the optimizer
        thread's step): an OpenMP team there waits for cores the devices' threads hold (30x slower
        seen on a loaded 2-core machine)."""
        previous = torch.get_num_threads() if self._cpu else None
        if previous is not None:
            limit_this_thread(1)
        try:
            yield
        finally:
            if previous is not None:
                limit_this_thread(previous)

    def _predicted(self, master: torch.Tensor) -> torch.Tensor | None:
        """The correction's predicted weights for ``master``, the time counted in the `OPT` op."""
        start = time.perf_counter()
        value = self.correction.predicted(master)
        self.stepper.count_step_time(time.perf_counter() - start)
        return value

    def correction_state(self) -> dict | None:
        """The staleness correction's state for a checkpoint (after a wait), ``None`` without one."""
        return None if self.correction is None else self.correction.state_dict()

    def load_correction_state(self, state: dict | None) -> None:
        """Restore :meth:`correction_state` from a checkpoint (ignored when of another correction)."""
        if self.correction is not None and state is not None:
            self.correction.load_state_dict(state)

    def pop_metrics(self) -> dict[str, float]:
        """Since the last call: ``roundpipe/optimizer_thread(s)``, seconds the thread ran optimizer
        steps, and ``roundpipe/optimizer_wait(s)``, seconds the main thread waited for them (0 when
        the overlap hides the step completely)."""
        if self.stepper is None:
            return {}
        busy_s, waited_s = self.stepper.pop_stats()
        return {"roundpipe/optimizer_thread(s)": busy_s, "roundpipe/optimizer_wait(s)": waited_s}

    # ------------------------------------------------------------------ the step
    def optimizer_step(self, optimizer: torch.optim.Optimizer, precision_step: Callable[[], Any]) -> Any:
        """Run ``precision_step`` (the precision plugin's ``optimizer_step``) with ``optimizer.step``
        deferred: the closure runs now, the step goes to the thread once the plugin returned.

        Returns:
            What ``precision_step`` returns (the closure's result).
        """
        recorded: list[dict] = []
        original = optimizer.step

        def deferred_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            # tensors as they are now: a GradScaler's `grad_scale`/`found_inf` for a fused optimizer
            # change in `scaler.update()`, which runs before the thread takes the step
            recorded.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
            if closure is None:
                return None
            with torch.enable_grad():
                return closure()

        functools.update_wrapper(deferred_step, original)  # keeps LR schedulers' `_wrapped_by_lr_sched` mark
        hooks: list[Callable[[], Any]] = []
        precision = self._precision if self.steady or self.correction is not None else None
        if precision is not None:  # the hooks and clipping wait for the gradients when the pipeline still drains
            original_after = precision._after_closure

            def after_closure(model: Any, optimizer_: Any) -> None:
                snapshot_updates, self._forward_updates = self._forward_updates, None
                if snapshot_updates is None:  # not a steady-state fused program: the snapshot read now
                    snapshot_updates = self._bank_updates[self.engine.store.read_bank]
                run = functools.partial(self._after_gradients, snapshot_updates, original_after, model, optimizer_)
                if self.steady and self.engine.overlap.incomplete():
                    hooks.append(run)
                else:
                    run()

            precision.__dict__["_after_closure"] = after_closure
        had = "step" in optimizer.__dict__
        previous = optimizer.__dict__.get("step")
        optimizer.__dict__["step"] = deferred_step
        try:
            result = precision_step()
        finally:
            if had:
                optimizer.__dict__["step"] = previous
            else:
                optimizer.__dict__.pop("step", None)
            if precision is not None:
                precision.__dict__.pop("_after_closure", None)
        step = _HeldStep(original, recorded, hooks)
        if self.steady and self.engine.overlap.incomplete():
            self._held = step  # completed when its gradients are (the next step's forward, or a drain)
        else:
            self._complete(step)
        return result


def _after(first: Callable[[], Any], then: Callable[[], Any]) -> Any:
    """``first()``, then ``then()`` (one job of the optimizer thread)."""
    first()
    return then()


@dataclass
class _HeldStep:
    """An optimizer step recorded by :meth:`AsyncOptimizer.optimizer_step`: the optimizer's own
    ``step``, the keyword arguments of each call, and the hooks deferred until its gradients are
    complete."""

    step: Callable[..., Any]
    updates: list[dict]
    hooks: list[Callable[[], Any]]


def _check_supported(lightning_module: Any, optimizers: list, engine: Any) -> None:
    if not lightning_module.automatic_optimization:
        raise ValueError(
            "`RoundPipeStrategy(optimizer='async')` supports automatic optimization only: with manual optimization"
            " `training_step` itself orders `zero_grad`, `backward` and `step` and may read the weights, so the"
            " step in flight cannot be overlapped safely. HINT: use `optimizer='sync'`, or automatic optimization."
        )
    pipelined = set(engine.store.tensors)
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "`RoundPipeStrategy(optimizer='async')` cannot run `torch.optim.LBFGS`: it re-evaluates the closure"
                " inside `step()`. HINT: use `optimizer='sync'` with LBFGS."
            )
        updated = {id(param) for group in optimizer.param_groups for param in group["params"]}
        outside = [name for name, param in lightning_module.named_parameters()
                   if id(param) in updated and id(param) not in pipelined]
        if outside:
            raise ValueError(
                f"`RoundPipeStrategy(optimizer='async')`: the optimizer updates parameters outside the pipelined module"
                f" ({', '.join(f'`{n}`' for n in outside[:5])}{', ...' if len(outside) > 5 else ''}); the main thread"
                " would read them while the optimizer thread updates them. HINT: move those modules into the"
                " pipelined model (`RoundPipeStrategy(module=...)`), freeze them, or use `optimizer='sync'`."
            )
