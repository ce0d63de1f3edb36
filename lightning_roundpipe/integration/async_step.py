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

import functools
from typing import Any, Callable

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_roundpipe.config import OPTIMIZER_MODES  # validated in RoundPipeConfig
from lightning_roundpipe.runtime.host.async_optimizer import BackgroundStepper
from lightning_roundpipe.runtime.execution.installed import InstalledMethod


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
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.controller.wait()

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

    def __init__(self) -> None:
        self.stepper: BackgroundStepper | None = None
        self.engine = None
        self.steps_submitted = 0
        self._patches: list[tuple[Any, str, bool, Any]] = []
        self._after_wait: list[Callable[[], Any]] = []  # deferred calls, run in order after the next wait
        self._callback: _WaitCallback | None = None
        self._trainer = None

    # ------------------------------------------------------------------ install / uninstall
    def install(self, trainer: Any, lightning_module: Any, optimizers: list, engine: Any) -> None:
        """Check the fit can run asynchronously, then hook the optimizers, the module and the engine.

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
        engine.store.snapshot = True
        engine.store.refresh(force=True)
        engine.grad_barrier = self.wait
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
        self._after_wait.clear()
        for owner, name, had, old in reversed(self._patches):
            if had:
                owner.__dict__[name] = old
            else:
                owner.__dict__.pop(name, None)
        self._patches.clear()
        if self.engine is not None:
            self.engine.grad_barrier = None
            self.engine.store.snapshot = False
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

    def synchronize(self) -> None:
        """:meth:`wait`, then refresh the pipeline's weight snapshot from the masters."""
        self.wait()
        if self.engine is not None:
            self.engine.store.refresh(force=True)

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
        # the gradients are final and the update before them applied: snapshot, then update
        self.synchronize()
        for kwargs in recorded:  # none when the plugin skipped the step (e.g. inf gradients)
            self.steps_submitted += 1
            self.stepper.submit(functools.partial(original, **kwargs), f"optimizer step {self.steps_submitted}")
        return result


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
